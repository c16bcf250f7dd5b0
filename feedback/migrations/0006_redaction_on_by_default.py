"""New projects redact e-mail addresses, API keys and tokens and IP addresses at ingest by default;
every project that exists now keeps what it had. A project without a DataPolicy row had redaction
off (the old default): it gets a row that says so, before the default changes."""

from django.db import migrations, models

import feedback.models


def keep_existing_projects_setting(apps, schema_editor):
    Project = apps.get_model("feedback", "Project")
    DataPolicy = apps.get_model("feedback", "DataPolicy")
    without = Project.objects.filter(data_policy__isnull=True).values_list("pk", flat=True)
    DataPolicy.objects.bulk_create(
        [DataPolicy(project_id=pk, consent_default="train", retention_days=None, erasure_policy="flag",
                    redactors=[], custom_patterns=[]) for pk in without.iterator()],
        batch_size=1000)


class Migration(migrations.Migration):

    dependencies = [
        ("feedback", "0005_users_data"),
    ]

    operations = [
        # Reversing leaves the rows: they hold exactly the old default's values.
        migrations.RunPython(keep_existing_projects_setting, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="datapolicy",
            name="redactors",
            field=models.JSONField(blank=True, default=feedback.models.default_redactors),
        ),
    ]
