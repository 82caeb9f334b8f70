"""A per-token tapered REINFORCE for nemo-is-plugin (``policy_objective: tapered_reinforce``): the example of
docs/writing_an_objective.md. Installed, its entry point (pyproject.toml) makes the plugin import
:mod:`tapered_reinforce.objective` before it builds its config."""
