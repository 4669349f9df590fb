#!/bin/bash
mkdir -p /app/out
echo yes > /app/out/ready.txt
