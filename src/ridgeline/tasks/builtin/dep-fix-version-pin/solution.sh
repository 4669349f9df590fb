#!/bin/bash
cd /app
sed -i 's/^tinyfmt==1.0.0$/tinyfmt==2.0.0/' requirements.txt
pip install --no-index --find-links wheelhouse --target vendor -r requirements.txt
