"""Webhook secrets encrypted at rest (core.secretbox); an empty secret is refused by the database."""

from django.db import migrations, models
from django.db.models import Q


def encrypt_existing(apps, schema_editor):
    from core import secretbox

    WebhookSecret = apps.get_model("feedback", "WebhookSecret")
    for row in WebhookSecret.objects.all():
        if row.secret:
            row.secret_encrypted = secretbox.encrypt(row.secret)
            row.save(update_fields=["secret_encrypted"])
        else:  # an empty secret never verified anything (every signed request failed): revoke it
            row.delete()


def decrypt_back(apps, schema_editor):
    from core import secretbox

    WebhookSecret = apps.get_model("feedback", "WebhookSecret")
    for row in WebhookSecret.objects.all():
        row.secret = secretbox.decrypt(row.secret_encrypted)
        row.save(update_fields=["secret"])


class Migration(migrations.Migration):
    dependencies = [("feedback", "0002_quarantine")]

    operations = [
        migrations.AddField("webhooksecret", "secret_encrypted", models.TextField(default="")),
        migrations.RunPython(encrypt_existing, decrypt_back),
        migrations.RemoveField("webhooksecret", "secret"),
        migrations.AlterField("webhooksecret", "secret_encrypted", models.TextField()),
        migrations.AddConstraint(
            "webhooksecret",
            models.CheckConstraint(condition=~Q(secret_encrypted=""), name="webhook_secret_not_empty"),
        ),
    ]
