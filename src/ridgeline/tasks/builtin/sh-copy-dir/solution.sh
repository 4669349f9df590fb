#!/bin/bash
cp -r /app/config /app/config_backup
