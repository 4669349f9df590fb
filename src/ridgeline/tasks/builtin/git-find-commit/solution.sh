#!/bin/bash
cd /app/repo
git log --format=%H -S 'DEBUG = True' -- settings.py | tail -n 1 > /app/answer.txt
