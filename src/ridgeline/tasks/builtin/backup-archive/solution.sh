#!/bin/bash
cd /app
tar --exclude='*.tmp' -czf backup.tar.gz docs
sha256sum backup.tar.gz > backup.sha256
