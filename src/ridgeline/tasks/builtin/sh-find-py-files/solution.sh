#!/bin/bash
find /app/project -type f -name '*.py' > /app/py_files.txt
