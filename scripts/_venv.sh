# Sourced by scripts/test and scripts/demo: make .venv (if needed) and install the project into it
# with `pip install -e '.[dev]'`.
#
# `python3 -m venv` needs ensurepip, which Debian and Ubuntu ship separately (python3-venv). Without
# it, the venv is made without pip and pip is bootstrapped from its wheel on PyPI (sha256-checked).

_venv_has_pip() {
    [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1
}

_venv_bootstrap_pip() {
    local tmp
    tmp="$(mktemp -d)"
    # Prints the path of the downloaded wheel; fails on any network, TLS or checksum problem.
    local wheel
    wheel="$(.venv/bin/python - "$tmp" <<'PY'
import hashlib, json, sys, urllib.parse, urllib.request
index = "https://pypi.org/pypi/pip/json"
info = json.load(urllib.request.urlopen(index, timeout=60))
wheel = next(u for u in info["urls"] if u["filename"].endswith("-py3-none-any.whl"))
data = urllib.request.urlopen(urllib.parse.urljoin(index, wheel["url"]), timeout=120).read()
if hashlib.sha256(data).hexdigest() != wheel["digests"]["sha256"]:
    sys.exit("pip wheel: sha256 mismatch")
path = f"{sys.argv[1]}/{wheel['filename']}"
open(path, "wb").write(data)
print(path)
PY
)" || { rm -rf "$tmp"; return 1; }
    .venv/bin/python "$wheel/pip" install -q "$wheel" || { rm -rf "$tmp"; return 1; }
    rm -rf "$tmp"
}

if ! _venv_has_pip; then
    rm -rf .venv
    if ! python3 -m venv .venv 2>/dev/null || ! _venv_has_pip; then
        echo "python3 -m venv could not install pip (no ensurepip); bootstrapping pip from PyPI" >&2
        rm -rf .venv
        python3 -m venv --without-pip .venv
        if ! _venv_bootstrap_pip; then
            rm -rf .venv
            echo "error: could not set up .venv with pip. On Debian/Ubuntu: sudo apt-get install python3-venv" >&2
            exit 1
        fi
    fi
fi
# Editable install: code changes need no reinstall, so pip runs again only when pyproject.toml changes.
if ! cmp -s pyproject.toml .venv/.installed-pyproject.toml; then
    .venv/bin/pip install -q -e '.[dev]'
    cp pyproject.toml .venv/.installed-pyproject.toml
fi
