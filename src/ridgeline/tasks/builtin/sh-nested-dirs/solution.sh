#!/bin/bash
mkdir -p /app/data/raw/2024
