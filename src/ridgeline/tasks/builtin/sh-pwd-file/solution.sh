#!/bin/bash
cd /app/work/deep
pwd > /app/where.txt
