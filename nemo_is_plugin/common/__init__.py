"""The ground floor: what every layer of the package may import (config, loss, kernels, distributed, adapters, apps).

``once`` (:func:`~nemo_is_plugin.common.once.warn_once`: the package's one once-per-process warning). No module here
imports torch or any other package module: importing it costs nothing and creates no cycle.
"""
