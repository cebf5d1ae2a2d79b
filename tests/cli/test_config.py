"""What people expect of a command line: `--version`, shell completion, a config file for defaults
(below the flags and the environment), and `subagent models` saying how to get the default."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents import __version__
from mlx_subagents.cli.config import KEYS, defaults_for, load_config
from mlx_subagents.cli.flags import Shared, shared_options
from mlx_subagents.home import state_home
from mlx_subagents.runs.tasks import DEFAULT_MODEL, MODEL_ENV
from tests.helpers import REPO, cli_env


@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`config(text)` writes `$MLX_SUBAGENTS_HOME/config.toml`; the default model it sets is undone after."""
    # Set, then deleted: so monkeypatch restores it after the test (unset here) whatever the file set in
    # this process (a delenv of an unset variable alone records nothing to undo).
    monkeypatch.setenv(MODEL_ENV, "")
    monkeypatch.delenv(MODEL_ENV)

    def write(text: str) -> Path:
        path = state_home() / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    return write


def test_version(run_cli: Any) -> None:
    assert run_cli("--version") == (
        0,
        f"subagent {__version__} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')})\n",
        "",
    )


@pytest.mark.process
def test_shell_completion_is_typers_for_the_subagent_command() -> None:
    # As a person runs it, from their shell: typer names the shell by walking up from its process.
    command = f"{shlex.quote(sys.executable)} -m mlx_subagents.cli --show-completion && :"  # bash stays its parent
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=cli_env(), timeout=60)
    script = done.stdout
    assert done.returncode == 0, done.stderr
    assert "_subagent_completion()" in script and "complete -o default -F _subagent_completion subagent" in script
    assert "_SUBAGENT_COMPLETE=complete_bash" in script


def test_config_model_is_below_the_flag_and_the_environment(
    tmp_path: Path, write_script: Any, run_cli: Any, config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_file, from_env, from_flag = (write_script([f"answer {n}"], f"{n}.json") for n in ("file", "env", "flag"))
    config(f'model = "{from_file}"\n')

    def model(*args: str) -> str:
        code, out, err = run_cli("run", "scout", "x", "-C", str(tmp_path), "--json", *args)
        assert code == 0, err
        return json.loads(out)["model"]

    assert model() == from_file
    monkeypatch.setenv(MODEL_ENV, from_env)
    assert model() == from_env
    assert model("--model", from_flag) == from_flag


def test_config_values_fill_only_the_flags_not_given(config: Any) -> None:
    path = config(
        'kv_budget = "4GB"\nsandbox = true\ngrammar = "off"\nengine = "http://gpu-box:8000/v1"\nprefill_slice = 64\n'
    )
    loaded = load_config()
    given = {"kv_budget": None, "sandbox": "off", "grammar": None, "engine": None, "prefix_cache": None, "model": None}
    given |= {"prefill_slice": None}
    assert defaults_for(given, loaded) == {
        "kv_budget": "4GB",
        "sandbox": "off",  # the flag wins
        "grammar": "off",
        "engine": "http://gpu-box:8000/v1",
        "prefix_cache": None,
        "model": None,  # the default model, not a model forced on every task
        "prefill_slice": "64",
    }
    assert loaded.lines() == [
        f"config    {path}: kv_budget = 4GB, sandbox = on, grammar = off, engine = http://gpu-box:8000/v1, "
        "prefill_slice = 64"
    ]


def test_sizes_config_toml_sets_keep_a_command_attached_to_the_server(config: Any) -> None:
    """`subagent serve` reads the same file: its sizes are the server's too, so only a flag or an engine
    makes a command's hosts its own (`own_hosts`, which `--standalone`-less commands ask before attaching)."""
    seen: list[Shared] = []
    command = shared_options()(lambda *, shared: seen.append(shared))
    config('kv_budget = "4GB"\nprefix_cache = "1GB"\n')
    command()
    command(kv_budget="2GB")
    config('engine = "http://gpu-box:8000/v1"\n')
    command()
    assert [(s.kv_budget, s.prefix_cache, s.own_hosts()) for s in seen] == [
        ("4GB", "1GB", None),
        ("2GB", "1GB", "--kv-budget"),
        (None, None, "--engine"),
    ]
    assert list(KEYS) == [
        "model",
        "kv_budget",
        "kv_bits",
        "sandbox",
        "grammar",
        "engine",
        "prefix_cache",
        "prefill_slice",
        "draft",
    ]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            'model = "x"\nkv_bugdet = "4GB"\n',
            "2: unknown key 'kv_bugdet'; the keys are model, kv_budget, kv_bits, sandbox, grammar, engine, prefix_cache, prefill_slice, draft",
        ),
        ('grammar = "maybe"\n', """1: grammar: 'maybe' is neither on nor off; write "on" or "off" (or true / false)"""),
        (
            '\n\nkv_budget = "lots"\n',
            "3: kv_budget: 'lots' is not a size; use e.g. 4GB, 512MiB, 0 (unbounded) or 0.25 (of RAM)",
        ),
        ("model = 3\n", "1: model: 3 is not text; write it in quotes"),
        (
            "prefill_slice = 0\n",
            """1: prefill_slice: 0 is not auto, off or a number of tokens; write "auto", "off" or e.g. 64""",
        ),
        ('draft = "always"\n', '1: draft: \'always\' is not auto, off or lookup; write "auto", "off" or "lookup"'),
    ],
)
def test_a_bad_config_line_is_one_error_naming_the_file_and_line(
    text: str, line: str, config: Any, run_cli: Any, tmp_path: Path
) -> None:
    path = config(text)
    code, out, err = run_cli("run", "scout", "x", "-C", str(tmp_path))
    assert (code, out, err) == (2, "", f"error: {path}:{line}\n")


def test_doctor_says_what_the_config_sets_without_a_file(run_cli: Any) -> None:
    assert load_config().lines() == [f"config    none ({state_home() / 'config.toml'} sets defaults for the flags)"]


def test_models_on_an_empty_machine_says_the_default_and_how_to_get_it(run_cli: Any, config: Any) -> None:
    code, out, err = run_cli("models")
    assert (code, out) == (0, "")
    assert err == (
        f"no models found; the default model, {DEFAULT_MODEL}, is not on this machine: get it with "
        f"`hf download {DEFAULT_MODEL}` (`pip install huggingface_hub` brings `hf`), pass --model, or import a GGUF "
        "file: subagent models import FILE.gguf (or ollama:NAME:TAG). On Linux or without a big model: "
        "docs/models.md#on-linux\n"
    )


# Where the README's "A first run" says its figures were made (the task names the workspace's path).
README_CHECKOUT = "/home/you/mlx-subagents"


def task_tokens(workspace: Path) -> int:
    """The scripted host's count of the demo's task message in `workspace`."""
    from mlx_subagents.agents.prompt import task_message
    from mlx_subagents.agents.session import workspace_for
    from mlx_subagents.host.engine.estimate import approx_tokens

    message = task_message("where is auth handled?", workspace_for(workspace))
    return approx_tokens([{"role": "user", "content": message}])


@pytest.mark.slow
def test_the_readmes_demo_runs_without_any_model(run_cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's "On Linux or without a big model" commands, as written there, from the checkout."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    demo = readme[readme.index("## On Linux or without a big model") :].split("```bash\n", 1)[1].split("```")[0]
    commands = [shlex.split(line.split("#")[0]) for line in demo.splitlines() if line.startswith("subagent ")]
    assert [c[:2] for c in commands] == [["subagent", "run"], ["subagent", "run"], ["subagent", "show"]]
    monkeypatch.chdir(REPO)  # the paths in the README are the checkout's
    code, out, err = run_cli(*commands[0][1:])
    assert code == 0 and out.startswith("Findings:\n- app/auth.py:4-8 — `login`"), err
    # "A first run"'s usage line is this replay's in a checkout at README_CHECKOUT. Here the task message,
    # which names the workspace, takes `d` tokens more (or fewer): in each of the three prompts, in the
    # two cached ones, and once in the context. Exact, however long this checkout's path is.
    assert f"in a checkout at `{README_CHECKOUT}`" in readme
    d = task_tokens(REPO / "examples" / "demo") - task_tokens(Path(README_CHECKOUT) / "examples" / "demo")
    figures = r"(\d+) turns, (\d+) in \((\d+) cached\), (\d+) out, context (\d+)"
    turns, n_in, cached, n_out, context = (int(n) for n in re.findall(figures, readme)[0])
    usage = [int(n) for n in re.findall(figures, err)[0]]
    assert usage == [turns, n_in + 3 * d, cached + 2 * d, n_out, context + d]
    code, out, _ = run_cli(*commands[1][1:])
    assert code == 0 and out.startswith("auth.py has login;")
    page = tmp_path / "run.html"
    code, _, err = run_cli(*commands[2][1:-1], str(page))
    assert code == 0 and "(4 tasks)" in err and page.read_text(encoding="utf-8").count('class="lane"') == 4
