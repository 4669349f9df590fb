#!/bin/bash
# Terminal-Bench v1 test runner. Under Terminal-Bench uv (and through it pytest) comes
# from the network; Ridgeline's harness provides both offline.
if ! command -v uvx >/dev/null 2>&1; then
    curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
    source "$HOME/.local/bin/env"
fi
if [ "$PWD" = "/" ]; then
    echo "Error: No working directory set. Please set a WORKDIR in your Dockerfile before running this script."
    exit 1
fi
uvx --with pytest==8.4.1 pytest "$TEST_DIR/test_outputs.py" -rA
