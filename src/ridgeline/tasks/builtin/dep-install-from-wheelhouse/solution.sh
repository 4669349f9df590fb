#!/bin/bash
cd /app
pip install --no-index --find-links wheelhouse --target vendor tinyfmt
