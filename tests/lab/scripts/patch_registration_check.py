"""Runs inside the vLLM CPU venv (not pytest): executes vllm-ascend's connector registration code from a source
tree and asks vLLM's KVConnectorFactory what the name "YuanrongConnector" resolves to. Prints one JSON object.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=TREE:REPO python tests/lab/scripts/patch_registration_check.py --path PATH [--preregister]

--path entry-point   vllm-ascend >= 0.11 style: vLLM's own general-plugin loader runs the entry point
                     `ascend_kv_connector = vllm_ascend:register_connector`, found in the sdist's
                     vllm_ascend.egg-info on PYTHONPATH (VLLM_PLUGINS restricts loading to that one plugin).
                     vllm_ascend._GLOBAL_PATCH_APPLIED is set first: the global patch it would apply
                     (vllm_ascend.utils.adapt_patch) imports torch_npu, which needs Ascend CANN.
--path package       vllm-ascend 0.10.0rc1 style: `import vllm_ascend.distributed` (the package whose import
                     registers the connectors; in a real deployment models/ops import it, and those need
                     torch_npu).
--preregister        call yrpd.connector.register() before vllm-ascend's code runs (the patch must not fail
                     when the name is already taken).

Without --preregister the registration runs with `yrpd` made unimportable, proving it is lazy: vllm-ascend
starts even where yrpd is not installed. Then yrpd is made importable again and the name is resolved through
KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="YuanrongConnector")) without a
kv_connector_module_path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=["entry-point", "package"], required=True)
    ap.add_argument("--preregister", action="store_true")
    args = ap.parse_args()
    result: dict = {"path": args.path, "preregister": args.preregister}

    if args.preregister:
        import yrpd.connector

        yrpd.connector.register()
    else:
        sys.modules["yrpd"] = None  # any import of yrpd now raises ImportError

    import vllm_ascend

    result["vllm_ascend_file"] = vllm_ascend.__file__
    if args.path == "entry-point":
        from importlib.metadata import entry_points

        eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
        result["entry_point"] = eps.get("ascend_kv_connector")
        vllm_ascend._GLOBAL_PATCH_APPLIED = True  # adapt_patch needs torch_npu (Ascend CANN)
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    else:
        import vllm_ascend.distributed  # noqa: F401

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    result["registered"] = "YuanrongConnector" in KVConnectorFactory._registry
    result["registry"] = sorted(KVConnectorFactory._registry)

    if not args.preregister:
        del sys.modules["yrpd"]
    from vllm.config import KVTransferConfig

    try:
        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="YuanrongConnector",
                                                                      kv_role="kv_both"))
    except ValueError as exc:
        result["resolved"] = None
        result["error"] = str(exc)
    else:
        import yrpd.connector.connector as impl

        result["resolved"] = f"{cls.__module__}.{cls.__qualname__}"
        result["is_yrpd_class"] = cls is impl.YuanrongConnector
        result["yrpd_file"] = sys.modules["yrpd"].__file__
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.exit(main())
