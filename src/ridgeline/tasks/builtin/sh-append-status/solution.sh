#!/bin/bash
echo finished >> /app/status.log
