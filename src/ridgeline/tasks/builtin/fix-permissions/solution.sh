#!/bin/bash
chmod a+x /app/scripts/*.sh
chmod 600 /app/secret.key
