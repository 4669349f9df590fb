#!/bin/bash
cd /app/repo
git checkout -q main
git merge -q --no-ff --no-edit feature
