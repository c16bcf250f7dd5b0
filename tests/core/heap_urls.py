"""A URLconf for tests/core/test_heap.py: imported only by the freeze it checks."""

urlpatterns: list = []
