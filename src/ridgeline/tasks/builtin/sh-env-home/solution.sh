#!/bin/bash
echo "$HOME" > /app/home.txt
