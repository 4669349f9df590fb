#!/bin/bash
rm /app/old.txt
