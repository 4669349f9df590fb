#!/bin/bash
cd /app
sed -i 's/^unitconvv==/unitconv==/' requirements.txt
pip install --no-index --find-links wheelhouse --target vendor -r requirements.txt
