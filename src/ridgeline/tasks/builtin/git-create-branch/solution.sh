#!/bin/bash
cd /app/repo
git checkout -q -b feature/login main
