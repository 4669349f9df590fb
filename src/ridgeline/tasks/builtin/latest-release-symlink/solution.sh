#!/bin/bash
cd /app
latest=$(ls releases | sort -V | tail -n 1)
ln -sfn "releases/$latest" current
