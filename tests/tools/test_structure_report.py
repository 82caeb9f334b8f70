"""tools/structure_report.py on a planted package: lines per layer, upward imports by kind, cycles with and without
the TYPE_CHECKING imports."""

from __future__ import annotations

import json
from pathlib import Path

from tools.structure_report import code_lines, main, report

PLANTED = {
    "__init__.py": '"""The root."""\n',
    "common/__init__.py": "",
    "config/__init__.py": (
        '"""Schema."""\n'
        "from typing import TYPE_CHECKING\n"
        "\n"
        "if TYPE_CHECKING:\n"
        "    from nemo_is_plugin.loss.model import Model\n"
        "\n"
        "\n"
        "def __getattr__(name):\n"
        "    # a lazy re-export: still an import of the loss\n"
        "    from nemo_is_plugin.loss import model\n"
        "\n"
        "    return getattr(model, name)\n"
    ),
    "loss/__init__.py": "",
    "loss/model.py": "from nemo_is_plugin.loss.objectives import base\n",
    "loss/objectives/__init__.py": "",
    "loss/objectives/base.py": (
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from nemo_is_plugin.loss.model import Model\n"
    ),
    "kernels/__init__.py": "",
    "kernels/a.py": "from nemo_is_plugin.kernels import b\n",
    "kernels/b.py": "from nemo_is_plugin.kernels import a\n",
    "apps/__init__.py": "",
}


def plant(root: Path) -> Path:
    for name, text in PLANTED.items():
        path = root / "nemo_is_plugin" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    source = '"""Doc\nstring."""\n\n# a comment\nx = (\n    1\n)\n\n\ndef f():\n    """Doc."""\n    return x  # why\n'
    assert code_lines(source) == 5  # x = ( / 1 / ) / def f(): / return x


def test_report_counts_rows_upward_imports_and_cycles(tmp_path):
    data = report(plant(tmp_path))
    assert data["rows"]["config"] == {"files": 1, "lines": 12, "code": 6, "files_over_400": 0}
    assert data["rows"]["loss/objectives"]["files"] == 2 and data["rows"]["loss"]["files"] == 2
    assert data["total"]["files"] == len(PLANTED)
    # config -> loss twice (annotation and lazy); objectives -> loss.model is the same layer, not upward
    assert [(u["module"], u["line"], u["kind"]) for u in data["upward"]] == [
        ("nemo_is_plugin/config/__init__.py", 5, "typing"),
        ("nemo_is_plugin/config/__init__.py", 10, "lazy"),
    ]
    assert data["cycles"] == [["nemo_is_plugin.kernels.a", "nemo_is_plugin.kernels.b"]]
    assert sorted(data["cycles_with_typing"]) == [
        ["nemo_is_plugin.kernels.a", "nemo_is_plugin.kernels.b"],
        ["nemo_is_plugin.loss.model", "nemo_is_plugin.loss.objectives.base"],
    ]


def test_main_prints_json_and_refuses_a_root_without_the_package(tmp_path, capsys):
    assert main(["--root", str(plant(tmp_path / "repo")), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["upward"]) == 2
    try:
        main(["--root", str(tmp_path / "missing")])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("a root without nemo_is_plugin/ was accepted")
    assert "no nemo_is_plugin/" in capsys.readouterr().err


def test_a_package_that_discovers_its_modules_imports_each_public_one(tmp_path):
    """``pkgutil.iter_modules(__path__)`` in a package's ``__init__`` (as loss/objectives does) imports its modules
    without naming them: each public module is an edge, so a TYPE_CHECKING import back closes a cycle."""
    root = plant(tmp_path)
    objectives = root / "nemo_is_plugin" / "loss" / "objectives"
    (objectives / "__init__.py").write_text(
        "import importlib\nimport pkgutil\n\nfor info in pkgutil.iter_modules(__path__):\n"
        "    importlib.import_module(f'{__name__}.{info.name}')\n"
    )
    (objectives / "_private.py").write_text("")
    (objectives / "gated.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from nemo_is_plugin.loss.model import Model\n"
    )
    (root / "nemo_is_plugin" / "loss" / "model.py").write_text("import nemo_is_plugin.loss.objectives\n")
    data = report(root)
    assert data["cycles"] == [["nemo_is_plugin.kernels.a", "nemo_is_plugin.kernels.b"]]
    loss = "nemo_is_plugin.loss"
    assert sorted(data["cycles_with_typing"]) == [
        ["nemo_is_plugin.kernels.a", "nemo_is_plugin.kernels.b"],
        [f"{loss}.model", f"{loss}.objectives", f"{loss}.objectives.base", f"{loss}.objectives.gated"],
    ]
