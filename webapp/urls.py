from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from feedback.apis import DatasetExportApi, IngestApi, TrajectoryDetailApi, TrajectoryListApi
from feedback.userdata.apis import UserExportApi
from webapp import views
from webapp.metrics import metrics_view
from webapp.throttle import ThrottledAdminAuthenticationForm, ThrottledAuthenticationForm

admin.site.login_form = ThrottledAdminAuthenticationForm
# A database error outside a view is a 503 page too (core/errors.py), never a 500 trace.
handler500 = "core.errors.server_error"
handler404 = views.not_found

api_v1 = [
    path("api/v1/events", IngestApi.as_view(), name="api-events"),
    path("api/v1/export", DatasetExportApi.as_view(), name="api-export"),
    path("api/v1/trajectories", TrajectoryListApi.as_view(), name="api-trajectories"),
    path("api/v1/trajectories/<path:external_id>", TrajectoryDetailApi.as_view(), name="api-trajectory"),
    path("api/v1/users/<str:user>/export", UserExportApi.as_view(), name="api-user-export"),
]

urlpatterns = [
    *api_v1,
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(authentication_form=ThrottledAuthenticationForm), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("healthz", views.healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("api/v1/", include("training.urls")),
    path("", include("webapp.dashboard_urls")),
]
