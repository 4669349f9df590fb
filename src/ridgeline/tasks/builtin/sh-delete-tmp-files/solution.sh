#!/bin/bash
rm /app/*.tmp
