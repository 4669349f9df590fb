#!/bin/bash
echo 'buy milk' >> /app/notes.txt
