#!/bin/bash
cp /app/report.txt /app/report_copy.txt
