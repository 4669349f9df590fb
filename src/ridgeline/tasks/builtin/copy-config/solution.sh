#!/bin/bash
cd /app/config
sed 's/^port = 8000$/port = 9000/' default.conf > local.conf
