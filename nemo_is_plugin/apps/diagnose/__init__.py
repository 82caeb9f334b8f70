"""Mismatch diagnostics of a rollout dump: what each IS level and truncation does to the weights, by length.

    from nemo_is_plugin.apps.diagnose import diagnose
    report = diagnose("runs/demo/rollouts.jsonl")
    report.print(); report.plot("runs/demo/diagnose")

Modules: ``dump`` (format, validation, writer), ``readers`` (JSONL / Parquet), ``synthetic`` (test dumps),
``settings`` (IS settings as loss configs), ``binning`` (length bins), ``analysis`` (weights via the loss's own
``compute_is_correction`` and mismatch metrics via ``loss.mismatch_metrics``), ``recommend``, ``tables`` (rich),
``plots``.
"""

from nemo_is_plugin.common.extras import require_extra

require_extra("cli", __name__)  # the app imports only with its extra

from nemo_is_plugin.apps.diagnose.dump import DumpError, RolloutDump, write_dump
from nemo_is_plugin.apps.diagnose.readers import read_dump
from nemo_is_plugin.apps.diagnose.report import DiagnoseReport, diagnose
from nemo_is_plugin.apps.diagnose.synthetic import synthetic_records

__all__ = ["DiagnoseReport", "DumpError", "RolloutDump", "diagnose", "read_dump", "synthetic_records", "write_dump"]
