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
printf 'RATE = 0.2\n\n\ndef with_tax(amount):\n    return round(amount * (1 + RATE), 2)\n' > tax.py
git add tax.py
commit "Add tax module"
printf '# Billing\n\nwith_tax(100) == 120.0\n' > README.md
git add README.md
commit "Add README"
sed -i 's/^RATE = 0.2$/RATE = 2.0/' tax.py
git add tax.py
commit "Break tax calculation"
printf '# Changelog\n\n- 1.1: changelog added\n' > CHANGELOG.md
git add CHANGELOG.md
commit "Add changelog"
