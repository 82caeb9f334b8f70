"""The one build step pyproject.toml cannot express: ``nemo_is_plugin_startup.pth`` at the root of site-packages.

site.py runs the ``import`` line of every ``.pth`` file in site-packages at interpreter start, whatever
``sitecustomize`` comes first on ``sys.path`` and under ``python -I``: that line runs the plugin's NeMo-RL start-up hook
(``nemo_is_plugin/adapters/nemo_rl/startup/``: NeMo-RL's ``loss_fn.name`` switch always, the head when
``NEMO_IS_NEMO_RL_HEAD`` is set), in every process of an environment the plugin is installed in. A wheel puts only
packages at the root of site-packages, so ``build_py`` copies the file there (setuptools' own
``distutils-precedence.pth`` is installed by a custom build step too), and the editable wheel (``pip install -e``)
carries it beside its own ``.pth``.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "nemo_is_plugin_startup.pth"
SOURCE = os.path.join("nemo_is_plugin", "adapters", "nemo_rl", "startup", PTH)


class build_py_with_startup_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class editable_wheel_with_startup_pth(editable_wheel):
    # an editable wheel holds what its strategy writes (its own .pth or finder) and the unpacked wheel directory,
    # not build_lib: the file goes into that directory, the wheel's root
    def _run_build_commands(self, dist_name, unpacked_wheel, *args, **kwargs):
        outputs = super()._run_build_commands(dist_name, unpacked_wheel, *args, **kwargs)
        shutil.copyfile(SOURCE, os.path.join(unpacked_wheel, PTH))
        return outputs


setup(cmdclass={"build_py": build_py_with_startup_pth, "editable_wheel": editable_wheel_with_startup_pth})
