#!/bin/bash
# Builds this task's git repository when the environment is created (no .git directory
# is committed with the task). Fixed names and dates make every hash reproducible.
set -euo pipefail
export GIT_AUTHOR_NAME="Ada Lovelace" GIT_AUTHOR_EMAIL="ada@example.com"
export GIT_COMMITTER_NAME="Ada Lovelace" GIT_COMMITTER_EMAIL="ada@example.com"
n=0
commit() {
    n=$((n + 1))
    local when="2024-01-01T10:$(printf %02d "$n"):00Z"
    GIT_AUTHOR_DATE="$when" GIT_COMMITTER_DATE="$when" git commit -q -m "$1"
}
mkdir -p /app/repo
cd /app/repo
git init -q -b main
git config user.name "Ada Lovelace"
git config user.email "ada@example.com"
printf '# Project\n' > README.md
git add README.md
commit "Initial commit"
printf 'remember the milk\n' > notes.txt
