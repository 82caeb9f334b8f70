"""``nemo-is demo``'s option handling (the run itself is in functional_tests/test_demo.py)."""

from typer.testing import CliRunner

from nemo_is_plugin.apps.cli.main import app


def test_a_run_config_that_is_not_a_mapping_is_a_clear_cli_error(tmp_path):
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("- grpo\n- warm_start\n")
    result = CliRunner().invoke(app, ["demo", "--run-config", str(run_yaml)])
    assert result.exit_code == 2, result.output
    assert "demo configuration error" in result.output and "mapping" in result.output
