"""Apply yrpd's patch series to the vllm-ascend tree inside the container, reinstall only when it changed.

Runs in the container with the image's own Python (the profile's `python`); yrpd's patch manager (yrpd/patches.py, which needs PyYAML and packaging,
both vLLM dependencies) and the series come in a bundle unpacked at args["bundle"]. Args: one JSON object
(see yrpd/steps/container.py). Writes args["marker"] when the tree is patched and the package that python3
imports is the patched tree; the deploy step's check looks for it.
"""
import importlib.util
import json
import sys
from pathlib import Path

ARGS = json.loads(sys.argv[1])
sys.path.insert(0, ARGS["bundle"])
from yrpd import patches as P  # noqa: E402
from yrpd.errors import YrpdError  # noqa: E402

tree = Path(ARGS["tree"])
if not tree.is_dir():
    print(f"the vllm-ascend source tree {tree} is not in this container: the container profile's source_tree "
          f"must name it (or be null when the image has none)", file=sys.stderr)
    sys.exit(1)
marker = Path(ARGS["marker"])
try:
    outcome = P.apply(tree, Path(ARGS["bundle"]) / "patches")
except P.UnsupportedVersion as exc:
    # vLLM loads yrpd's connector through kv_connector_module_path without any registration: the series only
    # adds the name to vllm-ascend's registry. A newer release without a series still serves; say so, patch nothing.
    print(f"warning: no yrpd patch series for {exc.target} {exc.version}: left unpatched; the instances load "
          f"yrpd's connector through kv_connector_module_path, which needs no registration", file=sys.stderr)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"series": None, "version": exc.version, "changed": False}) + "\n")
    sys.exit(0)
except YrpdError as exc:
    print(f"patch series: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)
print(outcome.message)
series, version = outcome.state.series, outcome.state.version.version
if outcome.changed and ARGS.get("reinstall"):
    print(f"reinstalling: {ARGS['reinstall']}", flush=True)
    returncode = P.run_reinstall(ARGS["reinstall"], tree, outcome)
    if returncode != 0:
        print(f"reinstall command exited {returncode}; the tree is patched, the installed package may be stale",
              file=sys.stderr)
        sys.exit(1)
# the patch only matters if the package this Python imports is this tree (an editable install)
found = importlib.util.find_spec(series.import_package)
origin = Path(found.origin).resolve() if found and found.origin else None
if origin is None or tree.resolve() not in origin.parents:
    print(f"{sys.executable} imports {series.import_package} from {origin or 'nowhere'}, not from the "
          f"patched tree {tree}: set the container profile's reinstall command (e.g. pip install -e .)",
          file=sys.stderr)
    sys.exit(1)
marker.parent.mkdir(parents=True, exist_ok=True)
# (applied outside yrpd, e.g. with the guide's `git am`, the tree has no record of ours)
marker.write_text(json.dumps({"series": series.id, "series_sha256": series.digest(), "version": version,
                              "changed": outcome.changed}) + "\n")
print(json.dumps({"series": series.id, "version": version, "changed": outcome.changed, "imports_from": str(origin)}))
