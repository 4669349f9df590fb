#!/bin/bash
ln -s /app/settings.conf /app/current.conf
