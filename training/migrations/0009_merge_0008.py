from django.db import migrations


class Migration(migrations.Migration):
    """Three 0008s written side by side (corpora and mid-training, staleness KL, lineage and
    erasure); they touch different tables."""

    dependencies = [
        ("training", "0008_corpora_midtrain"),
        ("training", "0008_run_lineage_erasure"),
        ("training", "0008_step_staleness_kl"),
    ]

    operations = []
