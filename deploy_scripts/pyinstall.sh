# Python installs for the install scripts: uv where it can run (a fraction of pip's time on the same pinned sets:
# docs/benchmarks.md), pip where it cannot, and one progress line per phase with its time. Sourced by install_vllm_cpu.sh,
# install_openyuanrong.sh and scripts/bootstrap.sh; yrpd ships it inlined into them (yrpd.assets.deploy_script).
#
#   pyi_init ROOT [WHEELS]   find or install uv (ROOT/uv, a venv of its own); once. WHEELS: every install takes
#                            its packages from that directory alone (no index)
#   pyi_install VENV ARG...  pip-style install arguments into VENV
#   pyi_uninstall VENV DIST...
#   pyi_compile VENV         the bytecode of VENV's packages, where uv installed them; VENV/$PYI_BYTECODE_MARK
#   pyi_phase LABEL CMD...   CMD's output into a log, one line with its time (the log's tail where it fails)
#
# uv reads no pip configuration: the index, extra indexes, find-links and constraints pip is configured with
# (`pip config list`: its files and PIP_* variables) are passed to it, and it picks the best version over all
# indexes as pip does (--index-strategy unsafe-best-match), so both install the same versions from the same places.
# YRPD_INSTALLER=pip installs with pip alone.

UV_VERSION="${UV_VERSION:-0.13.8}"
PYI_UV=""        # the uv binary once found; empty: pip
PYI_WHY_PIP=""   # why pip installs (said in each phase's line)
PYI_SOURCES=()   # pip's configured sources as uv's arguments
PYI_WHERE=()     # the wheel directory pyi_init was given, as both installers' arguments
PYI_READY=""
PYI_BYTECODE_MARK=".yrpd-bytecode"  # in a venv whose bytecode pyi_compile wrote (pip: while installing)

_pyi_log() { echo "[install] $*" >&2; }
_pyi_since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

pyi_init() {
    local root="$1" wheels="${2:-}" home="$1/uv" python="${PYTHON:-python3}"
    [[ -z "$PYI_READY" ]] || return 0
    PYI_READY=1 PYI_UV="" PYI_WHY_PIP="" PYI_WHERE=()
    [[ -z "$wheels" ]] || PYI_WHERE=(--no-index --find-links "$wheels")
    if [[ "${YRPD_INSTALLER:-uv}" == "pip" ]]; then
        PYI_WHY_PIP="YRPD_INSTALLER=pip"
        return 0
    fi
    if [[ "$("$home/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION"* ]]; then
        local log started
        log="$(mktemp)"
        started="$(date +%s.%N)"
        if ! { rm -rf "$home" && mkdir -p "$root" && "$python" -m venv "$home" \
                && "$home/bin/python" -m pip install --disable-pip-version-check --no-input -q "${PYI_WHERE[@]}" \
                    "uv==$UV_VERSION"; } >"$log" 2>&1 \
                || [[ "$("$home/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION"* ]]; then
            PYI_WHY_PIP="uv $UV_VERSION could not be installed: $(grep -v '^\s*$' "$log" | tail -n 1)"
            rm -rf "$home" "$log"
            return 0
        fi
        rm -f "$log"
        _pyi_log "uv $UV_VERSION into $home: $(_pyi_since "$started") s (pip)"
    fi
    PYI_UV="$home/bin/uv"
    # (the uv venv's own pip reads the configuration: the system Python may have none)
    mapfile -t PYI_SOURCES < <(pyi_pip_sources "$home/bin/python")
    local cert
    cert="${PIP_CERT:-$("$home/bin/python" -m pip config get global.cert 2>/dev/null || true)}"
    [[ -z "$cert" || -n "${SSL_CERT_FILE:-}" ]] || export SSL_CERT_FILE="$cert"
    # the cache and the venvs may sit on different file systems: copying says nothing
    export UV_LINK_MODE="${UV_LINK_MODE:-copy}"
}

# pyi_pip_sources PY: the sources PY's pip is configured with (its files and PIP_* variables), as uv's arguments, one
# per line
pyi_pip_sources() {
    "$1" - <<'EOF'
import ast, subprocess, sys

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
found = {}
# pip's precedence: its environment variables over its files' [install] over [global]
for section in (":env:", "install", "global"):
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        where, _, name = key.rpartition(".")
        if where == section and name not in found:
            found[name] = ast.literal_eval(value)
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
for name, flag in flags.items():
    for value in found.get(name, "").split():
        print(flag)
        print(value)
if found.get("no-index", "").lower() in ("1", "true", "yes", "on"):
    print("--no-index")
EOF
}

pyi_install() {
    local venv="$1"
    shift
    if [[ -n "$PYI_UV" ]]; then
        "$PYI_UV" pip install --python "$venv/bin/python" --index-strategy unsafe-best-match "${PYI_SOURCES[@]}" \
            "${PYI_WHERE[@]}" "$@"
    else
        "$venv/bin/python" -m pip install --disable-pip-version-check --no-input "${PYI_WHERE[@]}" "$@"
    fi
}

pyi_uninstall() {
    local venv="$1"
    shift
    if [[ -n "$PYI_UV" ]]; then
        "$PYI_UV" pip uninstall --python "$venv/bin/python" "$@"
    else
        "$venv/bin/python" -m pip uninstall -y "$@"
    fi
}

# pip writes the bytecode of what it installs, uv does not; and where PYTHONDONTWRITEBYTECODE is set (this kind of
# machine, many container images) no import writes it either, so every process compiled what it imported from source,
# every time: `import vllm.v1.engine.core` took 22-24 s on a 2-core EPYC against 11.6 s with the bytecode there, and
# each vLLM instance imports it in three processes. Written once here, on every core.
pyi_compile() {
    local site
    site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    [[ -d "$site" ]] || { echo "no site-packages in $1 ($site)" >&2; return 1; }
    if [[ -n "$PYI_UV" ]]; then
        # (some packages ship files that are not Python 3, templates and the like, which fail here: theirs to keep)
        "$1/bin/python" -m compileall -qq -j 0 "$site" || true
    fi
    touch "$1/$PYI_BYTECODE_MARK"
}

pyi_phase() {
    local label="$1" log started rc=0 how="${PYI_UV:+uv}"
    shift
    log="$(mktemp)"
    started="$(date +%s.%N)"
    "$@" >"$log" 2>&1 || rc=$?
    local took
    took="$(_pyi_since "$started")"
    if [[ "$rc" -ne 0 ]]; then
        _pyi_log "$label: failed after $took s (${how:-pip}); its last lines:"
        tail -n 30 "$log" >&2
        rm -f "$log"
        return "$rc"
    fi
    _pyi_log "$label: $took s (${how:-pip${PYI_WHY_PIP:+: $PYI_WHY_PIP}})"
    rm -f "$log"
}
