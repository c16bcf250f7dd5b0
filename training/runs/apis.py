"""HTTP API of mid-training: POST /api/v1/midtrain (admin) queues a mid-training run of the
project's production policy (or a version) on a corpus for the `train` workers; its candidate
goes to the gate like any run's. A thin view over training.runs.services.midtrain_start.

    curl -X POST -H "Authorization: Bearer $ADMIN_KEY" -H 'Content-Type: application/json' \
         -d '{"minutes": 5}' http://localhost:8000/api/v1/midtrain
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import Conflict
from feedback.auth import HasAdminScope
from training.corpora.apis import caller_project
from training.runs.services import midtrain_start


class MidtrainApi(APIView):
    """POST /api/v1/midtrain {"corpus"?, "steps" | "minutes", "from_version"?, "lr"?, ...}: 202 with
    the queued run (or 409 naming the run already active for the project)."""

    permission_classes = [HasAdminScope]

    class InputSerializer(serializers.Serializer):
        corpus = serializers.IntegerField(min_value=1, required=False)
        steps = serializers.IntegerField(min_value=1, max_value=10_000_000, required=False)
        minutes = serializers.FloatField(min_value=0.01, max_value=10080, required=False)
        from_version = serializers.IntegerField(min_value=1, required=False)
        lr = serializers.FloatField(min_value=1e-8, max_value=1.0, required=False)
        batch_size = serializers.IntegerField(min_value=1, max_value=4096, required=False)
        seq_len = serializers.IntegerField(min_value=2, max_value=32_768, required=False)
        seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)

        def validate(self, data):
            if ("steps" in data) == ("minutes" in data):
                raise serializers.ValidationError("give either steps or minutes (one of the two)")
            return data

    class OutputSerializer(serializers.Serializer):
        run = serializers.IntegerField(source="pk")
        kind = serializers.CharField()
        state = serializers.CharField()
        base_version = serializers.IntegerField(source="base_version.number")
        settings = serializers.JSONField()

    @extend_schema(request=InputSerializer, responses={202: OutputSerializer})
    def post(self, request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        project, actor = caller_project(request, role="admin")
        options = dict(data.validated_data)
        run, created = midtrain_start(project, started_by=actor if getattr(actor, "pk", None) else None,
                                      corpus=options.pop("corpus", None), steps=options.pop("steps", None),
                                      minutes=options.pop("minutes", None),
                                      from_version=options.pop("from_version", None), **options)
        if not created:
            raise Conflict(f"run {run.pk} is already {run.state} for {project.slug}",
                           "Wait for it to end (the runs page), then send again.", extra={"run": run.pk})
        return Response(self.OutputSerializer(run).data, status=202)
