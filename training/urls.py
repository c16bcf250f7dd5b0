"""API of the training app under /api/v1/ (versions, promotion, corpora, mid-training)."""

from django.urls import path

from training import apis
from training.corpora.apis import CorpusApi
from training.lineage import apis as lineage_apis
from training.runs.apis import MidtrainApi

urlpatterns = [
    path("versions", apis.VersionListApi.as_view(), name="api-versions"),
    path("versions/<int:version_id>", apis.VersionDetailApi.as_view(), name="api-version"),
    path("versions/<int:version_id>/approve", apis.VersionApproveApi.as_view(), name="api-version-approve"),
    path("versions/<int:version_id>/reject", apis.VersionRejectApi.as_view(), name="api-version-reject"),
    path("versions/<int:version_id>/rollback", apis.VersionRollbackApi.as_view(), name="api-version-rollback"),
    path("corpora", CorpusApi.as_view(), name="api-corpora"),
    path("data-policy", lineage_apis.DataPolicyApi.as_view(), name="api-data-policy"),
    path("consent/opt-outs", lineage_apis.OptOutApi.as_view(), name="api-opt-outs"),
    path("lineage", lineage_apis.LineageApi.as_view(), name="api-lineage"),
    path("erasures", lineage_apis.ErasureApi.as_view(), name="api-erasures"),
    path("midtrain", MidtrainApi.as_view(), name="api-midtrain"),
    path("training-config", apis.TrainingConfigApi.as_view(), name="api-training-config"),
]
