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
w() { printf '%s\n' "$@" > settings.py; git add settings.py; }
w 'NAME = "shop"' 'DEBUG = False'
commit "Initial settings"
w 'NAME = "shop"' 'DEBUG = False' 'DATABASE_URL = "sqlite:///shop.db"'
commit "Add database url"
w 'NAME = "shop"' 'DEBUG = False' 'DATABASE_URL = "sqlite:///shop.db"' 'CACHE_TTL = 60'
commit "Add cache settings"
w 'NAME = "shop"' 'DEBUG = False' 'DATABASE_URL = "sqlite:///shop.db"' 'CACHE_TTL = 60' 'LOG_LEVEL = "INFO"'
commit "Tweak logging"
w 'NAME = "shop"' 'DEBUG = True' 'DATABASE_URL = "sqlite:///shop.db"' 'CACHE_TTL = 60' 'LOG_LEVEL = "DEBUG"'
commit "Investigate slow checkout"
w 'NAME = "shop"' 'DEBUG = True' 'DATABASE_URL = "sqlite:///shop.db"' 'CACHE_TTL = 60' 'LOG_LEVEL = "DEBUG"' 'PAYMENT_KEY = "test"'
commit "Add payment keys"
w 'NAME = "shop"' 'DEBUG = True' 'DATABASE_URL = "sqlite:///shop.db"' 'CACHE_TTL = 300' 'LOG_LEVEL = "DEBUG"' 'PAYMENT_KEY = "test"'
commit "Update cache ttl"
printf '# Shop\n' > README.md
git add README.md
commit "Add readme"
