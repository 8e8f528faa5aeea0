#!/usr/bin/env bash
# System packages the test suite needs, from Debian's archive: prometheus (a real Prometheus
# scrapes a run's metrics endpoint in tests/test_metrics.py) and chromium (a headless browser
# loads the run report's page in tests/test_report.py). Installs only what is missing;
# needs root (or sudo) for apt-get when something is. Called by the README's test command and
# by .ci/run.
set -euo pipefail
packages=()
command -v prometheus >/dev/null || packages+=(prometheus)
command -v chromium >/dev/null || packages+=(chromium)
if ((${#packages[@]} == 0)); then
    exit 0
fi
sudo=()
if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null || {
        echo "tests/system/install.sh: installing ${packages[*]} (Debian packages) needs root" \
            "or sudo; install them and run the tests again" >&2
        exit 1
    }
    sudo=(sudo)
fi
command -v apt-get >/dev/null || {
    echo "tests/system/install.sh: no apt-get here; install ${packages[*]} (the Prometheus" \
        "server and the Chromium browser, as binaries on PATH) and run the tests again" >&2
    exit 1
}
echo "tests/system/install.sh: installing ${packages[*]} with apt-get" >&2
"${sudo[@]}" apt-get update -q >/dev/null
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${packages[@]}" >/dev/null
