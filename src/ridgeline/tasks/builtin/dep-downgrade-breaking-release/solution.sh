#!/bin/bash
cd /app
rm -rf vendor/tinyfmt vendor/tinyfmt-2.0.0.dist-info
pip install --no-index --find-links wheelhouse --target vendor tinyfmt==1.0.0
