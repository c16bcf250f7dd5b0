"""Schedules webapp.tasks.rollups_refresh every 60 s under django-celery-beat's DatabaseScheduler."""

from django.db import migrations


def schedule(apps, schema_editor):
    interval_model = apps.get_model("django_celery_beat", "IntervalSchedule")
    task_model = apps.get_model("django_celery_beat", "PeriodicTask")
    every, _ = interval_model.objects.get_or_create(every=60, period="seconds")
    task_model.objects.update_or_create(
        name="dashboard rollups refresh",
        defaults={"task": "webapp.tasks.rollups_refresh", "interval": every, "enabled": True},
    )


def unschedule(apps, schema_editor):
    apps.get_model("django_celery_beat", "PeriodicTask").objects.filter(name="dashboard rollups refresh").delete()


class Migration(migrations.Migration):
    dependencies = [
        ("webapp", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]
    operations = [migrations.RunPython(schedule, unschedule)]
