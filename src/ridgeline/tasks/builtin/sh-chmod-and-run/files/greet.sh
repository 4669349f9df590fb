#!/bin/bash
echo "greeting number $((6 * 7))"
