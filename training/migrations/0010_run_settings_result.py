"""TrainingRun.config -> `settings` (what the run was asked to do), its data window (`spec`,
`data_since`, `data_until`) and `result` (what it produced). A succeeded run's "flagged: ..."
error (its candidate was kept from the gate) moves to result["flag"]."""

from datetime import datetime

import django.db.models.deletion
from django.db import migrations, models

SETTINGS_KEYS = ("steps", "batch_size", "seed", "epochs", "rl", "group", "agent", "max_samples", "trajectory_ids")
# What a succeeded run's job reported, also under a settings key (the steps it took).
RESULT_TOO = ("steps",)


def _when(text):
    return datetime.fromisoformat(text) if text else None


def split_config(apps, schema_editor):
    TrainingRun = apps.get_model("training", "TrainingRun")
    RewardSpec = apps.get_model("training", "RewardSpec")
    for run in TrainingRun.objects.all().iterator():
        config = dict(run.config or {})
        run.settings = {k: config[k] for k in SETTINGS_KEYS if config.get(k) is not None}
        spec = config.pop("spec", None)
        run.spec_id = spec if spec is not None and RewardSpec.objects.filter(pk=spec).exists() else None
        run.data_since, run.data_until = _when(config.pop("data_since", None)), _when(config.pop("data_until", None))
        result = {k: v for k, v in config.items() if k not in SETTINGS_KEYS}
        if run.state == "succeeded":
            result.update({k: config[k] for k in RESULT_TOO if k in config})
            if run.error.startswith("flagged:"):
                result["flag"], run.error = run.error, ""
        run.result = result
        run.save(update_fields=["settings", "result", "spec", "data_since", "data_until", "error"])


def merge_config(apps, schema_editor):
    TrainingRun = apps.get_model("training", "TrainingRun")
    for run in TrainingRun.objects.all().iterator():
        result = dict(run.result or {})
        flag = result.pop("flag", "")
        run.config = {**run.settings, "spec": run.spec_id,
                      "data_since": run.data_since.isoformat() if run.data_since else None,
                      "data_until": run.data_until.isoformat() if run.data_until else None, **result}
        if flag:
            run.error = flag
        run.save(update_fields=["config", "error"])


class Migration(migrations.Migration):

    dependencies = [
        ('training', '0009_merge_0008'),
    ]

    operations = [
        migrations.AddField(
            model_name='trainingrun',
            name='settings',
            field=models.JSONField(default=dict),
        ),
        migrations.AddField(
            model_name='trainingrun',
            name='result',
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AddField(
            model_name='trainingrun',
            name='spec',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                                    related_name='runs', to='training.rewardspec'),
        ),
        migrations.AddField(
            model_name='trainingrun',
            name='data_since',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='trainingrun',
            name='data_until',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(split_config, merge_config),
        migrations.RemoveField(
            model_name='trainingrun',
            name='config',
        ),
    ]
