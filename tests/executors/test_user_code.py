"""The user's reward modules found at launch without importing them, and handed to the executors:
what is shipped, what is left to the installed environment, and the launch-time errors."""

from __future__ import annotations

import io
import json
import sys
import zipfile
from pathlib import Path

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import ConfigError, LaunchError
from diloco_serverless.executors._package import build_wheel
from diloco_serverless.executors.local import LocalProcessExecutor
from diloco_serverless.executors.user_code import UserModule, resolve_user_modules, search_path
from diloco_serverless.launcher.user_modules import check_user_modules, hand_user_modules

REWARDS = "def correct(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_local_file_is_shipped_and_nothing_is_imported(tmp_path: Path) -> None:
    _write(tmp_path / "my_rewards_a.py", "raise SystemExit('imported at launch')\n" + REWARDS)
    (module,) = resolve_user_modules(["my_rewards_a:correct"], path=[str(tmp_path)])
    assert module == UserModule("my_rewards_a", tmp_path / "my_rewards_a.py", ("my_rewards_a:correct",))
    assert module.files() == [("my_rewards_a.py", tmp_path / "my_rewards_a.py")] and module.root == tmp_path
    assert "my_rewards_a" not in sys.modules


def test_a_package_ships_whole_once_for_every_function_it_holds(tmp_path: Path) -> None:
    pkg = tmp_path / "my_pkg_b"
    _write(pkg / "__init__.py", "")
    _write(pkg / "scoring" / "__init__.py", "")
    _write(pkg / "scoring" / "math.py", REWARDS + "from .helpers import fmt as format_reward\n")
    _write(pkg / "answers.json", "{}")
    _write(pkg / "__pycache__" / "x.cpython-311.pyc", "")
    _write(pkg / ".secret", "")
    (module,) = resolve_user_modules(["my_pkg_b.scoring.math:correct", "my_pkg_b.scoring.math:format_reward"],
                                     path=[str(tmp_path)])
    assert module.is_package and module.path == pkg
    assert module.used_by == ("my_pkg_b.scoring.math:correct", "my_pkg_b.scoring.math:format_reward")
    assert [arc for arc, _ in module.files()] == ["my_pkg_b/__init__.py", "my_pkg_b/answers.json",
                                                  "my_pkg_b/scoring/__init__.py", "my_pkg_b/scoring/math.py"]


def test_installed_modules_and_the_package_itself_are_not_shipped(tmp_path: Path) -> None:
    pytest.importorskip("math_verify")
    paths = ["diloco_serverless.rl.rewards:format", "json:dumps", "math_verify:parse", "sys:exit"]
    assert resolve_user_modules(paths, path=search_path([str(tmp_path)])) == []


def test_the_working_directory_is_searched_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path / "cwd_rewards_c.py", REWARDS)
    monkeypatch.chdir(tmp_path)
    (module,) = resolve_user_modules(["cwd_rewards_c:correct"])
    assert module.path == tmp_path / "cwd_rewards_c.py"


@pytest.mark.parametrize(("files", "spec", "match"), [
    ({}, "nowhere_rewards:correct", r"cannot find module 'nowhere_rewards' of reward function "
                                    r"'nowhere_rewards:correct' on this machine \(looked in the working directory"),
    ({"r_d.py": REWARDS}, "r_d:wrong", r"r_d.py defines no function 'wrong' \(reward function 'r_d:wrong'\)"),
    ({"r_e.py": "def correct(:\n"}, "r_e:correct", r"r_e.py \(reward function 'r_e:correct'\) does not parse"),
    ({"r_f/__init__.py": ""}, "r_f.sub:correct", r"has no module 'sub' for reward function 'r_f.sub:correct'"),
    ({"r_g.so": ""}, "r_g:correct", r"r_g.so, not Python source; only source modules ship"),
    ({}, "r_h", r"'r_h' is not \"module:function\""),
])  # fmt: skip
def test_what_cannot_ship_is_a_config_error_naming_the_function(
    tmp_path: Path, files: dict[str, str], spec: str, match: str
) -> None:
    for name, text in files.items():
        _write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=match):
        resolve_user_modules([spec], path=[str(tmp_path)])


def test_names_bound_by_imports_blocks_and_star_imports_count(tmp_path: Path) -> None:
    _write(tmp_path / "r_i.py", "try:\n    from math import isclose as correct\nexcept ImportError:\n    pass\n")
    _write(tmp_path / "r_j.py", "from math import *\n")
    _write(tmp_path / "r_k.py", "if True:\n    correct = lambda **kw: []\n")
    found = resolve_user_modules(["r_i:correct", "r_j:anything", "r_k:correct"], path=[str(tmp_path)])
    assert [m.name for m in found] == ["r_i", "r_j", "r_k"]


def test_the_wheel_carries_the_users_modules_and_names_them_in_its_version(tmp_path: Path) -> None:
    _write(tmp_path / "wheel_rewards_l.py", REWARDS)
    modules = resolve_user_modules(["wheel_rewards_l:correct"], path=[str(tmp_path)])
    plain, with_user = build_wheel(), build_wheel(user_modules=modules)
    names = zipfile.ZipFile(io.BytesIO(with_user.data)).namelist()
    assert "wheel_rewards_l.py" in names
    assert "wheel_rewards_l.py" not in zipfile.ZipFile(io.BytesIO(plain.data)).namelist()
    record = zipfile.ZipFile(io.BytesIO(with_user.data)).read(next(n for n in names if n.endswith("/RECORD")))
    assert b"wheel_rewards_l.py,sha256=" in record
    assert with_user.version != plain.version and build_wheel(user_modules=modules).sha256 == with_user.sha256


def _rl_config(tmp_path: Path, reward: str) -> RunConfig:
    prompts = _write(tmp_path / "prompts.jsonl", json.dumps({"prompt": "say a", "answer": "a"}) + "\n")
    return RunConfig.load(None, [
        f"store={json.dumps(str(tmp_path / 'runs'))}", 'data.format="prompt"',
        f"data.source={json.dumps(str(prompts))}", 'loss.channel1="grpo"', f"rl.reward_funcs={json.dumps([reward])}",
        "rl.max_completion_length=4", "data.seq_len=32",
    ])  # fmt: skip


def test_preflight_refuses_a_reward_module_it_cannot_find(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _rl_config(tmp_path, "launch_rewards_m:correct")
    with pytest.raises(LaunchError, match="cannot find module 'launch_rewards_m'.*put launch_rewards_m.py"):
        check_user_modules(cfg)
    _write(tmp_path / "launch_rewards_m.py", REWARDS)
    (module,) = check_user_modules(cfg)
    assert module.name == "launch_rewards_m"
    assert check_user_modules(RunConfig.load(None, [])) == []  # supervised: no reward functions


def test_executors_get_the_modules_and_others_get_a_note(tmp_path: Path) -> None:
    module = UserModule("r_n", _write(tmp_path / "r_n.py", REWARDS), ("r_n:correct",))
    local = LocalProcessExecutor()
    assert hand_user_modules(local, [module]) == [] and local.user_modules == (module,)

    class Custom:
        kind = "custom"

    (note,) = hand_user_modules(Custom(), [module])  # type: ignore[arg-type]
    assert "does not ship your code" in note and "r_n:correct" in note


def test_local_replicas_get_the_modules_folder_on_their_path(tmp_path: Path) -> None:
    _write(tmp_path / "code" / "local_rewards_o.py", "print('local_rewards_o from', __file__)\n" + REWARDS)
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs", retries=0, poll_interval_s=0.1)
    ex.set_user_modules(resolve_user_modules(["local_rewards_o:correct"], path=[str(tmp_path / "code")]))
    handles = ex.launch_replicas(1, "local_rewards_o", [], env={})
    (result,) = ex.collect(handles, timeout=60)
    assert result.exit_code == 0
    assert f"local_rewards_o from {tmp_path / 'code' / 'local_rewards_o.py'}" in ex.logs(handles[0])
