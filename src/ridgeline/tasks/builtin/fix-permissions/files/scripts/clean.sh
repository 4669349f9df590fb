#!/bin/sh
echo cleaning
