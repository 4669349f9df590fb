#!/bin/bash
cd /app
sed -i '/^\[server\]/,/^\[/ s/^port = 80$/port = 8080/' settings.ini
printf '\n[logging]\nlevel = debug\n' >> settings.ini
