
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def _memberships_as_before(apps, schema_editor):
    """Who saw and decided what before memberships existed, kept at the upgrade: staff users
    view every project, staff who could approve (superusers, or holding
    training.approve_promotion directly or through a group) are its approvers. Narrow it in the
    admin; from here on access is per project."""
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    Project = apps.get_model("feedback", "Project")
    Membership = apps.get_model("feedback", "Membership")
    approve = dict(codename="approve_promotion", content_type__app_label="training")
    for user in User.objects.filter(is_staff=True, is_active=True):
        approver = (user.is_superuser or user.user_permissions.filter(**approve).exists()
                    or user.groups.filter(permissions__codename="approve_promotion").exists())
        for project in Project.objects.all():
            Membership.objects.get_or_create(project=project, user=user,
                                             defaults={"role": "approver" if approver else "viewer"})


class Migration(migrations.Migration):

    dependencies = [
        ('feedback', '0003_webhook_secret_encrypted'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='apikey',
            name='owner',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='api_keys', to=settings.AUTH_USER_MODEL),
        ),
        migrations.CreateModel(
            name='Membership',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('role', models.CharField(choices=[('viewer', 'viewer'), ('approver', 'approver'), ('admin', 'admin')], default='viewer', max_length=16)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('project', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='memberships', to='feedback.project')),
                ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='memberships', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('project', 'user'), name='uniq_membership'), models.CheckConstraint(condition=models.Q(('role__in', ['viewer', 'approver', 'admin'])), name='membership_role_known')],
            },
        ),
        migrations.RunPython(_memberships_as_before, migrations.RunPython.noop),
    ]
