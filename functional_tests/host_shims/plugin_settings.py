"""The plugin's settings the hosts' step tests share (the same keys in every host's section)."""

# CTPO's position-adaptive log-space clip on the cumulative ratio (arXiv 2605.07331), with the bounds the step tests
# use; each host's test adds its IS settings.
CTPO = {
    "ratio_level": "cumulative",
    "log_ratio_clip_low": 0.025,
    "log_ratio_clip_high": 0.05,
    "log_ratio_clip_c": 0.05,
    "clip_position_power": 0.5,
    "token_log_ratio_clamp": 20.0,
    "max_log_ratio": 10.0,
}
