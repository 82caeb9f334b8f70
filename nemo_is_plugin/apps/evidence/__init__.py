"""Evidence: published numerical claims about IS corrections and KL estimators (the research seeds docs/evidence.md
quotes) recomputed with the plugin's own functions (``nemo-is evidence``).

One module per experiment, each returning a JSON-ready dict:

- :mod:`.is_collapse`      IS-weight distribution of each correction level vs response length (docs/evidence.md, 1).
- :mod:`.ctpo_variance`    cumulative vs full-sequence ratio in per-token gradients (CTPO Prop. 2; docs/evidence.md, 2).
- :mod:`.kl_gradient_bias` expected gradients of the k1 / k2 / k3 / straight-through KL penalties (docs/evidence.md, 3).
- :mod:`.objectives`       one measured property per ``policy_objective`` on drifted synthetic batches
  (docs/evidence.md, 4); :mod:`.objective_shapes`: SAPO's gate, GMPO's spread, CPPO's budget;
  :mod:`.objective_experiment` runs both; :mod:`.objective_plots` draws them.
- :mod:`.rejection`        what each IS rejection rule rejects as the rollout mismatch grows (docs/evidence.md, 5);
  :mod:`.rejection_plots` draws it.

Support: :mod:`.mismatch` (synthetic log-prob mismatch), :mod:`.stats` (Monte Carlo errors and tests),
:mod:`.plots` (figures), :mod:`.runner` (runs everything, writes PNGs and ``evidence_numbers.json``).
See docs/evidence.md.
"""

from nemo_is_plugin.common.extras import require_extra

require_extra("cli", __name__)  # the app imports only with its extra
