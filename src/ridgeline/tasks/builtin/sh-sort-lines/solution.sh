#!/bin/bash
sort /app/fruits.txt > /app/sorted.txt
