"""API of the training app under /api/v1/ (versions, promotion, runs)."""

urlpatterns: list = []
